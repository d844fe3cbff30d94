"""Fake LLM inference engine: an OpenAI-compatible aiohttp server without a model.

It stands in for SGLang/vLLM on machines without a GPU. What it answers comes from
:mod:`luftpause.fakes.replies` (tool calls while tools are offered, then text); when it
answers comes from :mod:`luftpause.fakes.sim`, a continuous-batching model with a
bounded batch, a FIFO queue, a KV budget and a prefix cache, driven here by one loop
per engine in (scaled) real time. Around that: Prometheus ``/metrics`` in SGLang's or
vLLM's names (or llama.cpp's, TGI's, or none that tell load), the endpoints the SGLang router probes, vLLM's ``/classify``,
a native ``/v1/responses`` (OpenAI's Responses API over the same chat machinery, as vLLM
serves it), fault directives (:mod:`luftpause.fakes.faults`) and counters at ``/stats`` that tests use to
see what really reached the engine. It knows nothing about luftpause's headers.

Run it with ``python -m luftpause.fakes.engine --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from luftpause import logs
from luftpause.dataplane.responses_api import EventTranslator, ResponsesError, to_chat
from luftpause.fakes import faults as fault_directives
from luftpause.fakes import replies
from luftpause.fakes.faults import FaultError, Faults, StatusCounter
from luftpause.fakes.replies import Envelope, Reply, ReplyRules, RequestError
from luftpause.fakes.sim import CHARS_PER_TOKEN, EngineModel, ModelParams, SimRequest

log = structlog.get_logger(service="fake-engine")

ENV_PREFIX = "LUFTPAUSE_FAKE_ENGINE_"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine's behaviour depends on (one field per CLI option).

    The defaults make a quick engine for tests (a short request is answered in well
    under 100 ms and nothing queues); ``PRESETS`` hold calibrated engines.
    """

    host: str = "127.0.0.1"
    port: int = 9001
    extra_ports: tuple[int, ...] = ()  # more replicas in this process, sharing one GPU timeline
    name: str = "fake-engine"
    models: tuple[str, ...] = ("fake-llama-1b",)
    tool_calls: int = 2
    latency_ms: float = 20.0  # prefill pass base cost: time to first token of a short prompt
    token_ms: float = 2.0  # decode step base cost: time between tokens
    prefill_ms_per_token: float = 0.0
    decode_ms_per_request: float = 0.0
    max_running: int = 0
    reply_tokens: int = 12
    reply_spread: float = 0.0  # sigma of a log-normal spread of text reply lengths; 0 = fixed
    kv_tokens: int = 65536
    block_tokens: int = 16
    context_tokens: int = 0  # reply reservation without max_tokens: context − prompt; 0 = the planned reply
    max_prefill_tokens: int = 16384
    chunked_prefill_tokens: int = 2048  # SGLang's --chunked-prefill-size on GPUs under 20 GB; 0 = off
    cuda_graph_max_bs: int = 0  # decode batches above this pay --decode-eager-ms; 0 = never
    decode_eager_ms: float = 0.0
    metrics_interval_steps: int = 1  # decode steps between gauge refreshes (SGLang: 40); 1 = every step
    stream_interval: int = 1  # tokens per streamed chunk (SGLang's --stream-interval)
    time_scale: float = 1.0  # every simulated duration is multiplied by this
    seed: int = 0
    labels: tuple[str, ...] = ("negative", "positive")  # /classify labels
    metrics_format: str = "sglang"
    # More name sets for the same gauges, e.g. ("vllm",) beside SGLang's names, for a peer
    # router that reads only vLLM's (vllm-router's program scheduling): read-outs only
    also_metrics_formats: tuple[str, ...] = ()
    faults: tuple[str, ...] = ()  # engine-wide fault directives, e.g. ("status=503",)
    hang_limit_s: float = 3600.0  # a [[fake:hang]] request is dropped after this long
    idle_close_s: float = 0.0  # drop requests on connections idle longer than this (0 = never)

    def engine_faults(self) -> Faults:
        return fault_directives.parse(fault_directives.parse_option(f) for f in self.faults)

    def rules(self) -> ReplyRules:
        return ReplyRules(tool_calls=self.tool_calls, reply_tokens=self.reply_tokens)

    def params(self) -> ModelParams:
        return ModelParams(
            max_running=self.max_running,
            kv_tokens=self.kv_tokens,
            block_tokens=self.block_tokens,
            context_tokens=self.context_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
            chunked_prefill_tokens=self.chunked_prefill_tokens,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            decode_eager_ms=self.decode_eager_ms,
            metrics_interval_steps=self.metrics_interval_steps,
            prefill_base_ms=self.latency_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_base_ms=self.token_ms,
            decode_ms_per_request=self.decode_ms_per_request,
        )


# Calibrated engines. "laptop-1b": the earlier, uncalibrated guess at one of the original
# testbed's replicas (kept for comparison). "laptop-1b-sglang" (what the benchmarks use):
# Llama-3.2-1B FP8 under SGLang's default scheduler, two replicas sharing one 8 GB laptop
# GPU — serve both from one process (--extra-ports) so they share its timeline. Its
# scheduler constants are SGLang's defaults on a GPU under 20 GB (chunked prefill 2048,
# CUDA graphs up to batch 8, metrics every 40 decode steps, no running-request limit
# besides KV); only the physical constants (KV per replica, prefill and decode costs)
# were fitted, to the original's router and sequential figures alone, and then frozen:
# docs/calibration.md has the targets, the fit and the physical reading of each value.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {},
    "laptop-1b": {
        "max_running": 48,
        "kv_tokens": 24000,
        "block_tokens": 16,
        "context_tokens": 8192,
        "max_prefill_tokens": 8192,
        "chunked_prefill_tokens": 0,
        "latency_ms": 15.0,
        "prefill_ms_per_token": 0.06,
        "token_ms": 20.0,
        "decode_ms_per_request": 0.8,
        "reply_tokens": 150,
        "reply_spread": 0.5,
        "tool_calls": 8,
    },
    "laptop-1b-sglang": {
        "max_running": 0,
        "kv_tokens": 36000,
        "block_tokens": 16,
        "context_tokens": 8192,
        "max_prefill_tokens": 16384,
        "chunked_prefill_tokens": 2048,
        "cuda_graph_max_bs": 8,
        "decode_eager_ms": 20.0,
        "metrics_interval_steps": 40,
        "latency_ms": 15.0,
        "prefill_ms_per_token": 0.035,
        "token_ms": 12.0,
        "decode_ms_per_request": 0.8,
        "reply_tokens": 150,
        "reply_spread": 0.5,
        "tool_calls": 8,
    },
}


# --- the simulation loop --------------------------------------------------------------


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

    def __init__(self, time_scale: float) -> None:
        self.time_scale = time_scale
        self._lock = asyncio.Lock()
        self._free_at = 0.0
        self.busy_s = 0.0  # wall seconds of passes run, all replicas together
        self.lost_s = 0.0  # wall seconds the GPU fell behind its clock and did not catch up (a busy CPU)

    async def run(self, model_ms: float, continuing: bool = False) -> None:
        """Hold the GPU for one pass of ``model_ms`` model milliseconds; ``continuing``:
        the caller has had work since its last pass (it was not idle)."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if continuing and self.busy_s > 0:  # behind its clock: catch up at most MAX_LAG_S, the rest is lost
                start = max(self._free_at, now - self.MAX_LAG_S)
                self.lost_s += max(0.0, now - self.MAX_LAG_S - self._free_at)
            else:  # the replica was idle: its pass starts now, or when the other's ends
                start = max(self._free_at, now)
            duration = model_ms * self.time_scale / 1000
            end = start + duration
            self.busy_s += duration
            if end > now:
                await asyncio.sleep(end - now)
            else:
                await asyncio.sleep(0)
            self._free_at = end


class Simulator:
    """Drives :class:`EngineModel` in real time: one loop per replica runs prefill passes
    and decode steps on its (possibly shared) :class:`Gpu`, and wakes the handlers of
    requests that made progress. When idle, the gauges refresh after ``IDLE_METRICS_S``
    model seconds, as SGLang's idle self-check logs metrics every 30 s."""

    IDLE_METRICS_S = 30.0

    def __init__(self, params: ModelParams, time_scale: float, gpu: Gpu | None = None) -> None:
        self.model = EngineModel(params)
        self.time_scale = time_scale
        self.gpu = gpu if gpu is not None else Gpu(time_scale)
        self._wake = asyncio.Event()
        self._progress: dict[int, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.tokens_generated = 0

    def reset(self) -> bool:
        """Forget the prefix cache and counters (between benchmark variants); only when idle."""
        if self.model.busy:
            return False
        self.model = EngineModel(self.model.params)
        self.tokens_generated = 0
        return True

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
               reply_text: str = "") -> tuple[SimRequest, asyncio.Event]:
        self.start()
        request = self.model.submit(model, prompt_text, reply_tokens, max_tokens, reply_text)
        progress = asyncio.Event()
        self._progress[request.id] = progress
        self._wake.set()
        return request, progress

    def forget(self, request: SimRequest) -> None:
        """The handler is done with the request; a still-active one is aborted."""
        self._progress.pop(request.id, None)
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
        try:
            await asyncio.wait_for(self._wake.wait(), self.IDLE_METRICS_S * self.time_scale)
        except TimeoutError:
            self.model.refresh_gauges()
            await self._wake.wait()

    async def _run(self) -> None:
        continuing = False  # whether this replica has had work since its last pass
        while True:
            if not self.model.busy:
                await self._idle()
                continuing = False
                continue
            admitted = self.model.admit()
            if admitted:
                await self.gpu.run(self.model.prefill_ms(admitted), continuing)
                continuing = True
                self.model.finish_prefill(admitted)
                self.tokens_generated += sum(1 for r in admitted if r.prefilled)
                self._notify(admitted)
            elif self.model.decoding():
                batch = self.model.prepare_decode()
                await self.gpu.run(self.model.decode_ms(), continuing)
                continuing = True
                self.model.decode_step()
                self.tokens_generated += len(batch)
                self._notify(batch)
            else:  # waiting requests that cannot be admitted and nothing runs: cannot happen
                await self._idle()
                continuing = False


# --- engine state -------------------------------------------------------------------


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
        }


STATE_KEY = web.AppKey("engine_state", EngineState)


class EngineCollector(Collector):
    """Renders the model's gauges at scrape time, in the names of ``metrics_format``: running,
    queue and token usage as SGLang last refreshed them (see :mod:`luftpause.fakes.sim`),
    and the retractions so far as a counter."""

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = _METRIC_NAMES[self.state.config.metrics_format]
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
        counter = "sglang:num_retracted_reqs" if self.state.config.metrics_format == "sglang" else "vllm:num_preemptions"
        retracted = CounterMetricFamily(counter, "Requests sent back to the queue because a decode step ran out of KV.",
                                        labels=["model_name"])
        retracted.add_metric([self.state.config.models[0]], model.counters.retractions)
        yield retracted


    def _also(self, gauges: Any) -> Iterator[GaugeMetricFamily]:
        """The same running, queue and token-usage gauges again under each of
        ``also_metrics_formats``' names (nothing else: no second KV pool, no counters)."""
        primary = {name for name, _ in _METRIC_NAMES[self.state.config.metrics_format].values()}
        for fmt in self.state.config.also_metrics_formats:
            for key, (metric, doc) in _METRIC_NAMES[fmt].items():
                if metric in primary or key == "cache_hit_rate":
                    continue
                family = GaugeMetricFamily(metric, doc, labels=["model_name"])
                for name in self.state.config.models:
                    family.add_metric([name], {"running": gauges.running.get(name, 0),
                                               "queued": gauges.queued.get(name, 0),
                                               "token_usage": gauges.token_usage}[key])
                yield family

    def _kv_pool(self, model: Any) -> Iterator[GaugeMetricFamily]:
        """The KV pool's size and the tokens held (as stale as ``token_usage``), in the
        engine family's own names: SGLang's ``max_total_num_tokens`` and
        ``num_used_tokens``, vLLM's ``cache_config_info`` labels."""
        pool = model.params.kv_tokens
        if self.state.config.metrics_format == "sglang":
            total = GaugeMetricFamily("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.",
                                      labels=["model_name"])
            used = GaugeMetricFamily("sglang:num_used_tokens", "The number of used tokens.", labels=["model_name"])
            total.add_metric([self.state.config.models[0]], pool)
            used.add_metric([self.state.config.models[0]], round(model.gauges.token_usage * pool))
            yield total
            yield used
        else:
            block = model.params.block_tokens
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMCache configuration.",
                                     labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(block), str(pool // block)], 1)
            yield info


_METRIC_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    "sglang": {
        "running": ("sglang:num_running_reqs", "The number of running requests."),
        "queued": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
        "token_usage": ("sglang:token_usage", "The token usage (share of the KV cache in use)."),
        "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate of the last prefill batch."),
    },
    "vllm": {
        "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
        "queued": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
        "token_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    },
    "llamacpp": {  # llama-server --metrics
        "running": ("llamacpp:requests_processing", "Number of requests processing."),
        "queued": ("llamacpp:requests_deferred", "Number of requests deferred."),
    },
    "tgi": {
        "running": ("tgi_batch_current_size", "Current batch size"),
        "queued": ("tgi_queue_size", "Current queue size"),
    },
    "none": {  # an engine whose /metrics knows nothing of load (token counters only)
        "token_usage": ("engine_kv_cache_usage_ratio", "KV-cache usage."),
    },
}


# --- HTTP handlers ------------------------------------------------------------------


def _idle_close(limit_s: float):
    """Keep-alive as a real engine's server ends it, at its worst: a request that arrives
    on a connection idle for longer than ``limit_s`` finds it closed (llama-server keeps
    idle connections 5 s, uvicorn 5 s) — the race in which a client's pooled connection
    was closed by the server just as the client sent a request on it. The request is
    dropped unanswered and counted in ``/stats`` as ``stale_dropped``."""
    last_used: dict[Any, float] = {}

    @web.middleware
    async def middleware(request: web.Request, handler):
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        previous = last_used.pop(peer, None)
        if previous is not None and time.monotonic() - previous > limit_s:
            request.app[STATE_KEY].stale_dropped += 1
            log.info("chat.stale_connection_dropped", idle_s=round(time.monotonic() - previous, 3))
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: its connection is gone
        try:
            return await handler(request)
        finally:
            last_used[peer] = time.monotonic()

    return middleware



def _error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


async def _read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}") from exc


def _seeded_rng(seed: int, text: str) -> random.Random:
    """Randomness that depends on the seed and the prompt, not on arrival order."""
    digest = hashlib.blake2b(f"{seed}\x1f{text}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _reply_rules(config: EngineConfig, prompt_text: str) -> ReplyRules:
    rules = config.rules()
    if config.reply_spread <= 0:
        return rules
    factor = _seeded_rng(config.seed, prompt_text).lognormvariate(0.0, config.reply_spread)
    return replace(rules, reply_tokens=max(1, round(rules.reply_tokens * factor)))


@dataclass
class Turn:
    """One chat request on its way through the simulator."""

    request: web.Request
    state: EngineState
    body: dict[str, Any]
    reply: Reply
    envelope: Envelope
    faults: Faults
    top_logprobs: int | None
    sim_request: SimRequest | None = None
    progress: asyncio.Event | None = None

    def submit(self, prompt_text: str) -> None:
        reply_text = replies.render_message(self.reply.assistant_message())
        cap = replies.completion_cap(self.body)
        self.sim_request, self.progress = self.state.sim.submit(
            self.envelope.model, prompt_text, self.reply.completion_tokens, cap, reply_text)

    async def wait(self) -> None:
        assert self.progress is not None
        await self.progress.wait()
        self.progress.clear()

    def accounted_reply(self) -> Reply:
        r = self.sim_request
        assert r is not None
        return replace(self.reply, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens)

    def logprobs(self, deltas: list[dict[str, Any]], start: int) -> dict[str, Any] | None:
        """``logprobs`` of a chunk (or the whole reply) holding ``deltas`` from ``start``."""
        if self.top_logprobs is None:
            return None
        tokens = [replies.delta_text(d) for d in deltas]
        candidates = replies.logprob_candidates(self.body["messages"])
        seed = f"{self.state.config.seed}:{replies.render_prompt(self.body)[-200:]}"
        return {"content": replies.logprob_entries(tokens, candidates, self.top_logprobs, seed, start)}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: validate, queue in the simulator, answer.

    A streamed answer sends its headers before queueing, as engines behind an ASGI
    server do, so a client can be connected and waiting; a client that goes away at any
    point is counted in ``closed_early`` and frees its batch place or queue place at once.
    """
    state = request.app[STATE_KEY]
    state.requests += 1
    try:
        body = await _read_json(request)
        replies.validate(body, state.config.models)
        faults = state.faults.merged(fault_directives.from_messages(body["messages"]))
        top_logprobs = replies.logprobs_request(body)
    except RequestError as err:
        log.info("chat_rejected", status=err.status, reason=str(err))
        return _error(err)
    except FaultError as err:
        log.info("chat_rejected", status=400, reason=str(err))
        return _error(RequestError(str(err)))
    status = fault_directives.error_status(faults, body["messages"], state.status_counter)
    if status is not None:
        log.info("chat_fault_status", status=status)
        return web.json_response(fault_directives.error_body(status), status=status,
                                 headers=faults.error_headers(status))
    prompt_text = replies.render_prompt(body)
    reply = replies.plan_reply(body, _reply_rules(state.config, prompt_text), faults)
    turn = Turn(request, state, body, reply, Envelope.new(body["model"]), faults, top_logprobs)
    started = time.monotonic()
    log.info("chat_request", id=turn.envelope.id, model=turn.envelope.model, stream=bool(body.get("stream")))
    try:
        if faults.hang or (faults.stall_after is not None and not body.get("stream")):
            response = await _hang(request, state)
        elif body.get("stream"):
            response = await _stream(turn, prompt_text, replies.wants_usage_chunk(body))
        else:
            response = await _complete(turn, prompt_text)
    except _Aborted:
        log.info("chat_aborted", id=turn.envelope.id, after_s=round(time.monotonic() - started, 3))
        return web.Response(status=500)  # never reaches the client: its connection is gone
    except (asyncio.CancelledError, ConnectionResetError):
        state.closed_early += 1
        log.info("chat_closed_early", id=turn.envelope.id, after_s=round(time.monotonic() - started, 3))
        raise
    finally:
        if turn.sim_request is not None:
            state.sim.forget(turn.sim_request)
    r = turn.sim_request
    log.info(
        "chat.done",
        id=turn.envelope.id,
        finish_reason=reply.finish_reason,
        prompt_tokens=r.prompt_tokens if r else reply.prompt_tokens,
        cached_tokens=r.cached_tokens if r else 0,
        completion_tokens=reply.completion_tokens,
        duration_s=round(time.monotonic() - started, 3),
    )
    return response


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``, served natively as vLLM serves it: over the engine's own chat
    machinery. The request goes as a chat completion to this same engine (the same queue,
    cache and pace) and its reply comes back as a Response or its event stream."""
    state = request.app[STATE_KEY]
    state.responses_requests += 1
    try:
        document = await _read_json(request)
        chat = to_chat(document if isinstance(document, dict) else {})
    except RequestError as err:
        return _error(err)
    except ResponsesError as err:
        return web.json_response(err.body(), status=err.status)
    own = f"http://{request.host}/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(own, json=chat.body) as upstream:
        if upstream.status != 200 or not chat.body["stream"]:
            body = await upstream.read()
            if upstream.status == 200:
                body = chat.shell.response_body(json.loads(body))
            return web.Response(status=upstream.status, body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = EventTranslator(chat.shell)
        await response.write(events.start())
        async for piece in upstream.content.iter_any():
            if out := events.feed(piece):
                await response.write(out)
        await response.write_eof()
        return response


class _Aborted(Exception):
    """The connection was aborted on purpose (``[[fake:die-after=N]]``)."""


def _abort(request: web.Request) -> None:
    """Drop the TCP connection at once, with no further bytes (a crashed engine)."""
    if request.transport is not None:
        request.transport.abort()
    raise _Aborted


async def _hang(request: web.Request, state: EngineState) -> web.StreamResponse:
    """Never answer; the client's disconnect cancels this (counted in ``closed_early``).

    Bounded by ``hang_limit_s`` so a forgotten client cannot pin the handler forever.
    """
    await asyncio.sleep(state.config.hang_limit_s)
    _abort(request)
    raise AssertionError("unreachable")


async def _complete(turn: Turn, prompt_text: str) -> web.Response:
    """Non-streaming: the same prefill and decode time, delivered in one body."""
    turn.submit(prompt_text)
    request = turn.sim_request
    assert request is not None
    while request.state not in ("finished", "aborted"):
        await turn.wait()
        if turn.faults.die_after is not None and request.prefilled:
            _abort(turn.request)
    reply = turn.accounted_reply()
    pieces = list(replies.stream_pieces(reply))
    return web.json_response(replies.completion_body(reply, turn.envelope, turn.logprobs(pieces, 0)))


async def _stream(turn: Turn, prompt_text: str, include_usage: bool) -> web.StreamResponse:
    """SSE: role chunk once prefilled, then the reply's pieces as tokens are generated
    (every ``stream_interval`` tokens), then the closing chunks and ``[DONE]``.

    A client that goes away surfaces as ``ConnectionResetError`` on the next write, or
    at once as cancellation when the server runs with ``handler_cancellation`` (as
    ``main`` does).
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(turn.request)
    turn.submit(prompt_text)
    request = turn.sim_request
    assert request is not None
    pieces = list(replies.stream_pieces(turn.reply))
    interval = max(1, turn.state.config.stream_interval)
    sent_pieces, sent_tokens, role_sent = 0, 0, False
    die_after = turn.faults.die_after
    while True:
        await turn.wait()
        if request.state == "aborted":
            raise ConnectionResetError("request aborted")
        if not request.prefilled:
            continue
        if not role_sent:
            await _send(response, turn.envelope.chunk({"role": "assistant", "content": ""}))
            role_sent = True
        finished = request.state == "finished"
        if not finished and request.generated - sent_tokens < interval:
            continue
        total = max(1, request.reply_tokens)
        due = len(pieces) if finished else min(len(pieces), math.floor(request.generated * len(pieces) / total))
        if die_after is not None:
            due = min(due, die_after)
        if turn.faults.stall_after is not None:
            due = min(due, turn.faults.stall_after)
        for start in range(sent_pieces, due, interval):  # one chunk per interval's worth of pieces
            batch = pieces[start : min(due, start + interval)]
            await _send(response, turn.envelope.chunk(replies.merge_deltas(batch),
                                                      logprobs=turn.logprobs(batch, start)))
        sent_pieces, sent_tokens = max(sent_pieces, due), request.generated
        if die_after is not None and (sent_pieces >= die_after or finished):
            _abort(turn.request)
        if turn.faults.stall_after is not None and (sent_pieces >= turn.faults.stall_after or finished):
            await _hang(turn.request, turn.state)
        if finished:
            break
    for chunk in replies.closing_chunks(turn.accounted_reply(), turn.envelope, include_usage):
        await _send(response, chunk)
    await response.write(b"data: [DONE]\n\n")
    if turn.faults.linger_after_done_ms:
        await asyncio.sleep(turn.faults.linger_after_done_ms / 1000)
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


# --- one-pass classification (vLLM /classify) ------------------------------------------


def _class_probs(config: EngineConfig, text: str) -> list[float]:
    rng = _seeded_rng(config.seed, "classify\x1f" + text)
    scores = [rng.gauss(0.0, 1.5) for _ in config.labels]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


async def classify(request: web.Request) -> web.Response:
    """``POST /classify`` (vLLM): ``{"model", "input": str | [str]}`` → one label per input.

    Each input is a prefill-only request through the same batch and KV pool as chat
    turns, so classifying costs engine time like on a real replica.
    """
    state = request.app[STATE_KEY]
    state.requests += 1
    try:
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in state.config.models:
            raise RequestError(f"The model `{model}` does not exist.", status=404, code="model_not_found")
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
            raise RequestError("input must be a string or a non-empty list of strings")
    except RequestError as err:
        return _error(err)
    model_name = model or state.config.models[0]
    submitted = [state.sim.submit(model_name, text, 0, 0) for text in inputs]
    try:
        for sim_request, progress in submitted:
            while sim_request.state not in ("finished", "aborted"):
                await progress.wait()
                progress.clear()
    except asyncio.CancelledError:
        state.closed_early += 1
        raise
    finally:
        for sim_request, _ in submitted:
            state.sim.forget(sim_request)
    data = []
    for index, text in enumerate(inputs):
        probs = _class_probs(state.config, text)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": state.config.labels[best], "probs": probs,
                     "num_classes": len(probs)})
    prompt = sum(r.prompt_tokens for r, _ in submitted)
    return web.json_response({
        "id": "classify-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model_name,
        "data": data,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0},
    })


# --- discovery: models, health, and what the SGLang router probes ------------------------


async def models(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    created = int(time.time())
    data = [{"id": m, "object": "model", "created": created, "owned_by": config.name} for m in config.models]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info`` (and ``/get_server_info``), without ``model_path`` or
    ``tokenizer_path``: with them the router would try to fetch a tokenizer."""
    config = request.app[STATE_KEY].config
    return web.json_response({
        "version": "fake",
        "served_model_name": config.models[0],
        "max_running_requests": config.max_running,
        "max_total_num_tokens": config.kv_tokens,
        "page_size": config.block_tokens,
        "context_length": config.context_tokens or None,
        "stream_interval": config.stream_interval,
        # Batches up to this size decode from captured CUDA graphs; larger ones run eagerly.
        "cuda_graph_max_bs": config.cuda_graph_max_bs or None,
        "disable_cuda_graph": False,
        "dp_size": 1,
        "tp_size": 1,
    })


async def model_info(request: web.Request) -> web.Response:
    config = request.app[STATE_KEY].config
    return web.json_response({"is_generation": True, "model_type": "fake", "architectures": ["FakeForCausalLM"],
                              "served_model_name": config.models[0]})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's ``/get_load`` (polled by the router's ``power_of_two`` policy)."""
    model = request.app[STATE_KEY].sim.model
    return web.json_response([{
        "dp_rank": 0,
        "num_reqs": len(model.running) + len(model.waiting),
        "num_waiting_reqs": len(model.waiting),
        "num_tokens": model.used_tokens,
    }])


def token_ids(text: str) -> list[int]:
    """The prompt "tokenised" as the engine model counts it (one token per
    ``CHARS_PER_TOKEN`` characters), each token's id a hash of its characters: the same
    text gives the same ids, and a shared prefix a shared run of ids."""
    return [int.from_bytes(hashlib.blake2b(text[i:i + CHARS_PER_TOKEN].encode(), digest_size=4).digest()) % 128_000
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def _text_to_tokenize(body: Any) -> str:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if isinstance(body.get("messages"), list):
        return replies.render_prompt(body)
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    raise RequestError("give messages (a list) or prompt (a string)")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` ({prompt} or {messages}): the prompt's token ids, which
    vllm-router's cache_aware and kv_aware policies ask workers for. A read-out: it
    touches no engine state."""
    try:
        ids = token_ids(_text_to_tokenize(await _read_json(request)))
    except RequestError as err:
        return _error(err)
    config = request.app[STATE_KEY].config
    return web.json_response({"count": len(ids), "max_model_len": config.context_tokens or 8192, "tokens": ids,
                              "token_strs": None})


async def render_chat(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/chat/completions/render``: the token ids the chat request's prompt
    renders to (the same as ``/tokenize``), without generating. A read-out."""
    try:
        body = await _read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise RequestError("messages (a list) is required")
        ids = token_ids(_text_to_tokenize(body))
    except RequestError as err:
        return _error(err)
    return web.json_response({"request_id": f"render-{uuid.uuid4().hex}", "model": body.get("model"),
                              "token_ids": ids, "features": None})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].stats())


async def set_faults(request: web.Request) -> web.Response:
    """``PUT /faults`` ``{"faults": ["hang"]}``: the engine-wide fault directives from now
    on, as ``--fault`` sets them at start (``[]`` heals it); requests already waiting
    keep theirs. For injecting a fault into a running engine (``make chaos`` load mode)."""
    state = request.app[STATE_KEY]
    try:
        body = await request.json()
        options = body["faults"]
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise ValueError("'faults' must be a list of strings")
        state.faults = fault_directives.parse(fault_directives.parse_option(o) for o in options)
    except (ValueError, KeyError, TypeError, FaultError) as err:
        return web.json_response({"error": {"message": f"bad faults: {err}"}}, status=400)
    log.info("engine_faults_set", faults=options)
    return web.json_response({"faults": options})


async def reset(request: web.Request) -> web.Response:
    """``POST /reset``: an empty cache and zero counters, as after a restart (409 while busy)."""
    state = request.app[STATE_KEY]
    if not state.sim.reset():
        return web.json_response({"error": {"message": "engine is busy"}}, status=409)
    state.requests = state.closed_early = 0
    return web.json_response(state.stats())


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.faults.metrics_hang:  # --fault metrics-hang: load cannot be read
        await asyncio.sleep(state.config.hang_limit_s)
    registry = request.app[REGISTRY_KEY]
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


REGISTRY_KEY = web.AppKey("metrics_registry", CollectorRegistry)


def create_app(config: EngineConfig, gpu: Gpu | None = None) -> web.Application:
    """The engine as an aiohttp app, for ``main`` and for in-process tests; replicas
    given the same ``gpu`` share its timeline (one process, one GPU)."""
    if config.metrics_format not in _METRIC_NAMES:
        raise ValueError(f"metrics_format must be one of {sorted(_METRIC_NAMES)}")
    if any(f not in _METRIC_NAMES for f in config.also_metrics_formats):
        raise ValueError(f"also_metrics_formats must be among {sorted(_METRIC_NAMES)}")
    state = EngineState(config=config, sim=Simulator(config.params(), config.time_scale, gpu),
                        faults=config.engine_faults())
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(state))
    app = web.Application(middlewares=[_idle_close(config.idle_close_s)] if config.idle_close_s > 0 else [])
    app[STATE_KEY] = state
    app[REGISTRY_KEY] = registry

    async def stop_sim(app: web.Application) -> None:
        await state.sim.stop()

    app.on_cleanup.append(stop_sim)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/classify", classify)
    app.router.add_post("/v1/classify", classify)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/stats", stats)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/reset", reset)
    app.router.add_put("/faults", set_faults)
    app.router.add_get("/metrics", metrics)
    return app


# --- command line -------------------------------------------------------------------


def _env(name: str, default: object) -> str:
    return os.environ.get(ENV_PREFIX + name, str(default))


def _preset_defaults(argv: Sequence[str] | None) -> tuple[str, EngineConfig]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default=_env("PRESET", "quick"))
    known, _ = pre.parse_known_args(argv)
    return known.preset, replace(EngineConfig(), **PRESETS[known.preset])


def parse_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """CLI options, each defaulting to ``LUFTPAUSE_FAKE_ENGINE_<OPTION>`` from the
    environment, else to the chosen ``--preset``'s value."""
    preset, d = _preset_defaults(argv)
    p = argparse.ArgumentParser(
        prog="python -m luftpause.fakes.engine",
        description="Fake OpenAI-compatible LLM engine (no model): a continuous-batching simulator with a "
                    "KV budget and prefix cache, /metrics, /classify, fault directives.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def option(flag: str, env: str, kind: type, default: object, text: str) -> None:
        p.add_argument(flag, type=kind, default=kind(_env(env, default)), help=f"{text} [env {ENV_PREFIX}{env}]")

    p.add_argument("--preset", choices=sorted(PRESETS), default=preset,
                   help=f"calibrated defaults for the options below [env {ENV_PREFIX}PRESET]")
    option("--host", "HOST", str, d.host, "address to listen on")
    option("--port", "PORT", int, d.port, "TCP port to listen on")
    option("--name", "NAME", str, d.name, "engine name used in logs and as owned_by in /v1/models")
    option("--models", "MODELS", str, ",".join(d.models), "comma-separated model names served")
    option("--tool-calls", "TOOL_CALLS", int, d.tool_calls,
           "answer with a tool call while tools are offered and the conversation has fewer than N "
           "assistant tool-call turns; text afterwards")  # fmt: skip
    option("--latency-ms", "LATENCY_MS", float, d.latency_ms,
           "base cost of a prefill pass, ms (time to first token of a short prompt)")
    option("--token-ms", "TOKEN_MS", float, d.token_ms, "base cost of one decode step, ms (time between tokens)")
    option("--prefill-ms-per-token", "PREFILL_MS_PER_TOKEN", float, d.prefill_ms_per_token,
           "prefill cost per uncached prompt token, ms")
    option("--decode-ms-per-request", "DECODE_MS_PER_REQUEST", float, d.decode_ms_per_request,
           "decode step cost per running request, ms")
    option("--max-running", "MAX_RUNNING", int, d.max_running,
           "most requests generating at once; others wait FIFO (reported as queue); 0 = unlimited")  # fmt: skip
    option("--reply-tokens", "REPLY_TOKENS", int, d.reply_tokens, "tokens (words) in a text reply (median)")
    option("--reply-spread", "REPLY_SPREAD", float, d.reply_spread,
           "log-normal sigma of text reply lengths (seeded per prompt); 0 = always --reply-tokens")
    option("--kv-tokens", "KV_TOKENS", int, d.kv_tokens, "KV cache size in tokens (admission budget, prefix cache)")
    option("--block-tokens", "BLOCK_TOKENS", int, d.block_tokens, "prefix-cache block size in tokens")
    option("--context-tokens", "CONTEXT_TOKENS", int, d.context_tokens,
           "context length: a request without max_tokens reserves context − prompt tokens; "
           "0 = it reserves its planned reply only")
    option("--max-prefill-tokens", "MAX_PREFILL_TOKENS", int, d.max_prefill_tokens,
           "uncached prompt tokens one prefill batch takes at most")
    option("--chunked-prefill-tokens", "CHUNKED_PREFILL_TOKENS", int, d.chunked_prefill_tokens,
           "new tokens one prefill pass takes at most; a longer prompt continues in the next pass; 0 = no chunking")
    option("--cuda-graph-max-bs", "CUDA_GRAPH_MAX_BS", int, d.cuda_graph_max_bs,
           "largest decode batch run as a CUDA graph; larger batches pay --decode-eager-ms more; 0 = no step")
    option("--decode-eager-ms", "DECODE_EAGER_MS", float, d.decode_eager_ms,
           "extra cost of a decode step above --cuda-graph-max-bs, ms")
    option("--metrics-interval-steps", "METRICS_INTERVAL_STEPS", int, d.metrics_interval_steps,
           "decode steps between refreshes of the /metrics gauges (SGLang: 40); they also refresh after "
           "every prefill pass and after 30 idle model seconds")
    option("--extra-ports", "EXTRA_PORTS", str, ",".join(map(str, d.extra_ports)),
           "comma-separated ports of more replicas served by this process on the same simulated GPU "
           "(one GPU shared by several SGLang replicas: one replica's pass delays the others'); "
           "replica i is named <name>-<i> when there are several")
    option("--stream-interval", "STREAM_INTERVAL", int, d.stream_interval, "tokens per streamed chunk")
    option("--time-scale", "TIME_SCALE", float, d.time_scale,
           "multiplies every simulated duration (0.25 = four times faster than the modelled engine)")
    option("--seed", "SEED", int, d.seed, "seed of reply lengths and classifier scores")
    option("--labels", "LABELS", str, ",".join(d.labels), "comma-separated /classify labels")
    option("--idle-close-s", "IDLE_CLOSE_S", float, d.idle_close_s,
           "a request arriving on a kept-alive connection idle longer than this is dropped unanswered, "
           "as when a server's keep-alive timer closes it just as the request is sent; 0 = never")
    p.add_argument(
        "--metrics-format",
        choices=sorted(_METRIC_NAMES),
        default=_env("METRICS_FORMAT", d.metrics_format),
        help=f"Prometheus metric names to expose [env {ENV_PREFIX}METRICS_FORMAT]",
    )
    p.add_argument(
        "--also-metrics-format",
        default=_env("ALSO_METRICS_FORMAT", ",".join(d.also_metrics_formats)),
        help="comma-separated further name sets for the running, queue and token-usage gauges (e.g. vllm, "
             f"for a router that reads only vLLM's names); read-outs only [env {ENV_PREFIX}ALSO_METRICS_FORMAT]",
    )
    p.add_argument("--fault", action="append", default=[], metavar="DIRECTIVE",
                   help="engine-wide fault directive, repeatable: status=503, status-times=429:2, "
                        "retry-after=3, die-after=4, stall-after=4, linger-after-done=500, hang, metrics-hang, "
                        "tool-call-as-text, schema-as-arguments, string-scalars (the same as [[fake:...]] in a "
                        "message); PUT /faults {\"faults\": [...]} replaces them while it runs")
    a = p.parse_args(argv)
    try:
        fault_directives.parse(fault_directives.parse_option(f) for f in a.fault)
    except FaultError as err:
        p.error(str(err))
    model_names = tuple(m.strip() for m in a.models.split(",") if m.strip())
    if not model_names:
        p.error("--models needs at least one name")
    labels = tuple(x.strip() for x in a.labels.split(",") if x.strip())
    if len(labels) < 2:
        p.error("--labels needs at least two labels")
    if a.time_scale <= 0:
        p.error("--time-scale must be positive")
    values = {f.name: getattr(a, f.name) for f in fields(EngineConfig) if hasattr(a, f.name)}
    try:
        extra_ports = tuple(int(x) for x in a.extra_ports.split(",") if x.strip())
    except ValueError:
        p.error("--extra-ports must be comma-separated port numbers")
    also = tuple(x.strip() for x in a.also_metrics_format.split(",") if x.strip())
    if any(f not in _METRIC_NAMES for f in also):
        p.error(f"--also-metrics-format takes names among {sorted(_METRIC_NAMES)}")
    values.update(models=model_names, labels=labels, faults=tuple(a.fault), extra_ports=extra_ports,
                  also_metrics_formats=also)
    return EngineConfig(**values)


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per replica this process serves (``--port`` and ``--extra-ports``)."""
    if not config.extra_ports:
        return [config]
    ports = (config.port, *config.extra_ports)
    return [replace(config, port=port, extra_ports=(), name=f"{config.name}-{i}") for i, port in enumerate(ports)]


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logs.configure("fake-engine")
    structlog.contextvars.bind_contextvars(engine=config.name)
    log.info("engine_start", **asdict(config))
    if not config.extra_ports:
        web.run_app(
            create_app(config),
            host=config.host,
            port=config.port,
            access_log=None,
            print=None,
            handler_cancellation=True,  # a client disconnect cancels its request, as in real engines
            shutdown_timeout=1.0,
        )
        return
    try:
        asyncio.run(_serve_replicas(replica_configs(config)))
    except KeyboardInterrupt:
        pass


async def _serve_replicas(configs: list[EngineConfig]) -> None:
    """Several replicas on one GPU timeline, each app on its own port, until SIGTERM/SIGINT."""

    gpu = Gpu(configs[0].time_scale)
    runners = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for config in configs:
            runner = web.AppRunner(create_app(config, gpu), access_log=None, handler_cancellation=True,
                                   shutdown_timeout=1.0)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, config.host, config.port).start()
            log.info("engine_replica", name=config.name, port=config.port)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()


if __name__ == "__main__":
    main()
